"""Attribution runs (SPEC section 8): what each head reads from the input, beside what it attends to."""

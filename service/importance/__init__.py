"""Head importance and pruning curves (SPEC section 7): jobs, storage and the REST API."""

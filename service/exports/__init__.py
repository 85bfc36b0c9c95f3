"""Exports for pruning tools: a selection of a model's heads in the forms of SPEC section 5."""

"""Ablations of heads by type (SPEC section 4): plans, jobs, stored outcomes, Tables 2 and 3."""

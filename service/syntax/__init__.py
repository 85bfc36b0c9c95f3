"""Syntax runs (SPEC section 9): which heads track which dependency relations."""

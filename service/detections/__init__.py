"""Head detectors (SPEC 10): detection runs of catalog models, their per-head scores and roles."""

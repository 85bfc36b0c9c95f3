"""The catalog's web page (``/``) and the read endpoints it needs beyond the REST contract."""

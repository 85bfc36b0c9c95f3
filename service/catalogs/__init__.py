"""Catalog archives: export a catalog as Parquet files with a manifest, import another one (issue 26)."""

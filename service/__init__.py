"""The headcat application: settings, database, ORM, REST endpoints, jobs and CLI.

The API process never needs torch to answer a query: modules that run models import
``ingest`` lazily, inside the job that needs it.
"""

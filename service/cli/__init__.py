"""``headcat``: the command line, one module per command group.

========================  ===========================================================
module                    commands
========================  ===========================================================
``app``                   the Typer app, logging, the catalog database, running a job
``database``              ``db upgrade``, ``db url``, ``db psql``
``keys``                  ``keys create``, ``keys list``, ``keys revoke``
``ingests``               ``ingest``
``clusterings``           ``cluster``, ``stability``
``workers``               ``worker``, ``jobs``
``models``                ``models``
``current``               ``current``
``serving``               ``serve``
``demo``                  ``quickstart``
``exports``               ``export``
``catalogs``              ``catalog export``, ``catalog import``
``ablations``             ``ablate``, ``report``
``importance``            ``importance``, ``prune-curve``
``attributions``          ``attribute``
``syntax_runs``           ``syntax``
``detections``            ``detect``
========================  ===========================================================

Importing this package registers every command on ``app`` (in the order ``headcat --help`` lists them).
"""

# The import order is the order the commands are registered in, and --help lists them in.
# isort: off
from service.cli.app import app, catalog, console, invalid_input, log, main, progress_bar, run_job
from service.cli.database import db_app, db_psql, db_upgrade, db_url
from service.cli.keys import keys_app, keys_create, keys_list, keys_revoke
from service.cli.ingests import ingest, ingest_model
from service.cli.clusterings import cluster_command, cluster_models, print_types, stability
from service.cli.workers import jobs, worker
from service.cli.models import list_models
from service.cli.current import current_command
from service.cli.serving import serve, serve_catalog
from service.cli.demo import DEMO_NAME, PAPER_QUERY, QUICKSTART_CLUSTERING, quickstart
from service.cli.exports import export_command
from service.cli.catalogs import catalog_app, catalog_export, catalog_import
from service.cli.ablations import ablate, report
from service.cli.importance import importance_command, prune_curve_command
from service.cli.attributions import attribute
from service.cli.syntax_runs import syntax
from service.cli.detections import detect

# isort: on

__all__ = [
    "DEMO_NAME", "PAPER_QUERY", "QUICKSTART_CLUSTERING", "ablate", "app", "attribute", "catalog", "catalog_app",
    "catalog_export", "catalog_import", "cluster_command",
    "cluster_models", "console", "db_app", "db_psql", "db_upgrade", "db_url", "export_command", "importance_command",
    "ingest", "ingest_model", "invalid_input", "jobs", "keys_app", "keys_create", "keys_list", "keys_revoke",
    "current_command", "list_models", "log", "main", "print_types", "progress_bar", "prune_curve_command",
    "quickstart", "report", "run_job", "serve", "serve_catalog", "stability", "syntax", "worker", "detect",
]  # fmt: skip

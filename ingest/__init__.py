"""The science of headcat: model loading, attention features, clustering, stability, ablation.

Nothing here imports FastAPI or touches the database: functions take models, corpora and
arrays, and return arrays and frozen result objects that ``service`` stores.
"""

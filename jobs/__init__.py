"""Job scripts, scaling studies and a scaling model for DeepFusion (see jobs/README.md).

    python -m jobs.render  render a batch script for a cluster profile (jobs/clusters.toml)
    python -m jobs.sweep   run / aggregate a ranks x threads scaling study
    python -m jobs.model   alpha-beta scaling model, validated against the DeepFusion talk
"""

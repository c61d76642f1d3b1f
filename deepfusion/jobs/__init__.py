"""Job scripts, scaling studies and a scaling model for DeepFusion (see docs/clusters.md).

    deepfusion jobs render  render a batch script for a cluster profile (deepfusion/jobs/clusters.toml)
    deepfusion jobs sweep   run / aggregate a ranks x threads scaling study
    deepfusion jobs model   alpha-beta scaling model, validated against the DeepFusion talk
"""

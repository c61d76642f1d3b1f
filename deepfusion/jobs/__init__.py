"""Job scripts, scaling studies, scaling models and time-to-accuracy projections for DeepFusion
(see docs/clusters.md), as ``deepfusion jobs TOOL`` (:mod:`.cli`):

    deepfusion jobs render   render a batch script for a cluster profile (deepfusion/jobs/clusters.toml)
    deepfusion jobs sweep    run / aggregate a ranks x threads scaling study
    deepfusion jobs model    alpha-beta scaling model, validated against the DeepFusion talk
    deepfusion jobs project  time to accuracy on a cluster, from a batch study or a recipe's plan

What they ask of ``train`` (its start-up checks, the level plan, the probe) goes through
:mod:`deepfusion.app.checks` only.
"""

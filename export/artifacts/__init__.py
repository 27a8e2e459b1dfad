"""The torch-free half of export/: what a model package is and where it lives.

``package`` (the model-package format: manifest, file hashes, golden check, onnxruntime
sessions), ``repository`` (REPO/NAME/VERSION layout, publishing, promotion.json),
``records`` (the one lock and crash-safe writes of promotion.json and rollout.json),
``gate`` (the rules a new version must pass to be published) and ``vocabulary`` (the word
tokenizer of training and the service). The export command writes with these modules and
the service reads with them, so the format lives once. They import numpy and onnxruntime
only: never torch, orthornn.models, orthornn.training nor ``..builder`` (import-linter
contract in pyproject.toml).
"""

"""The loop's offline half (docs/capture.md, docs/drift.md), torch-free and without the
serving stack (numpy, orjson; river, scipy and tqdm inside the functions that use them): what the
retraining job's commands and the exporter read and compute. The serving half is
``service.loop``.

- ``captures``: the capture folder's layout and records, read side; the id and replica
  rules, ``--since``, the progress bar: each written once for both halves;
- ``dataset``: a training set from the labelled captures (``orthornn capture dataset``);
- ``drift``: the drift reference (its file, the summaries, the calibrated tests), and
  ``drift_statistics``, the two-sample statistics it uses;
- ``error_rate``: each version's error rate on the labelled captures, and its change.
"""

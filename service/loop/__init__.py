"""The loop while serving (docs/capture.md, docs/drift.md): what the service keeps of its
traffic for retraining and monitoring. The offline half (the captures' reader, the data
set, drift references and tests, the error rate) is ``export.artifacts.loop``, torch-free
and without the serving stack, which the retraining job's commands use.

- ``ids``: a request's capture id, checked at the edge, and the sample by its hash;
- ``records``: what a record holds, encoded once per batch line;
- ``disk``: space reserved ahead, why a write failed, the UTC days;
- ``capture``: the segment writer (one per replica), retention, the answers of sessions;
- ``index``: one model's captured and labelled ids, read incrementally;
- ``labels``: labels checked against the version that answered, and their store;
- ``drift``: live drift windows per version against its package's reference.
"""

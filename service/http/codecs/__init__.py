"""One codec per protocol: request bodies into the typed requests the dataplane takes
(``service.dataplane.messages``, or the protocol's pydantic request where that is already
typed), and its results into bodies. Each keeps its fast path (simdjson) and its pydantic fallback
inside; the pydantic schemas themselves are in ``service.dataplane.schemas``.

    predict_json  POST /predict (and the shared pydantic parse)
    oip_json      the Open Inference Protocol's JSON tensors
    oip_binary    its binary tensor data extension (on top of oip_json)
"""

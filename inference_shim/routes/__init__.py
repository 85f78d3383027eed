"""The server's HTTP routes, one APIRouter per concern, each built from the backend and what its routes need:

    generation.py     /v1/chat/completions, /v1/completions, /v1/models
    weights.py        /init_process_group, /request_weight_update, /destroy_process_group (token)
    introspection.py  /health, /capabilities, /debug/state, /metrics

inference_shim/server.py assembles them into the app, with what every route shares: error handlers,
middleware (API key, limits, metrics) and the lifespan that starts and stops the engine.
"""

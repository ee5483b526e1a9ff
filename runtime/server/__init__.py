"""HTTP server: SGLang's native /generate and the OpenAI-compatible /v1 API over an Engine.

    server, ctx = build_server(ServerArgs(port=30000))   # or serve(args) to run until SIGTERM

Modules: app (routes, auth, uvicorn), engine_loop (the engine thread), native_api and
openai_api (endpoints), protocol (request bodies), openai_format (reply bodies), serving
(shared submission and streaming), errors (OpenAI-style error replies).
"""

from runtime.server.app import build_server, create_app, serve

__all__ = ["build_server", "create_app", "serve"]

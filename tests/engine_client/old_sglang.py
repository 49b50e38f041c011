"""A stand-in for an old SGLang build (≤ v0.5.5 style), for the client's version-drift paths.

- ``/pause_generation`` and ``/continue_generation`` answer 422 to a body, 200 without one;
- ``/model_info``, ``/server_info``, ``/v1/loads`` do not exist (404); the ``/get_*`` ones do;
- ``/flush_cache`` answers 400 the first ``state["flush_busy"]`` times;
- ``/health`` answers ``state["health"]``;
- ``/generate`` answers the error shape named by the request's rid (``shape-*``);
- every request's Authorization header is recorded per path in ``state["auth"]``.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

SHAPES = {
    "shape-validation": (400, {"object": "error", "message": "bad field x", "type": "Bad Request", "param": None, "code": 400}),
    "shape-valueerror": (400, {"error": {"message": "token id 9 out of vocab"}}),
    "shape-unauthorized": (401, {"error": "Unauthorized"}),
    "shape-detail": (422, {"detail": "field required"}),
    "shape-success-false": (400, {"success": False, "message": "weights refused"}),
    "shape-text": (503, "engine overloaded"),
}


def build_app():
    state = {"flush_busy": 2, "flush_calls": 0, "health": 200, "auth": {}, "bodies": {}}
    app = FastAPI()

    @app.middleware("http")
    async def record(request: Request, call_next):
        state["auth"][request.url.path] = request.headers.get("authorization")
        return await call_next(request)

    async def no_body_only(request: Request, message: str) -> Response:
        raw = await request.body()
        state["bodies"].setdefault(request.url.path, []).append(raw)
        if raw:
            return JSONResponse({"detail": "this version takes no body"}, status_code=422)
        return JSONResponse({"message": message, "status": "ok"})

    @app.post("/pause_generation")
    async def pause(request: Request):
        return await no_body_only(request, "Generation paused successfully.")

    @app.post("/continue_generation")
    async def cont(request: Request):
        return await no_body_only(request, "Generation continued successfully.")

    @app.get("/get_model_info")
    async def get_model_info():
        return {"model_path": "old", "tokenizer_path": "old", "is_generation": True, "preferred_sampling_params": None, "weight_version": "7"}

    @app.get("/get_server_info")
    async def get_server_info():
        return {"version": "0.5.4", "internal_states": []}

    @app.get("/get_load")
    async def get_load():
        return {"loads": [{"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0}]}

    @app.get("/flush_cache")
    async def flush():
        state["flush_calls"] += 1
        if state["flush_calls"] <= state["flush_busy"]:
            return PlainTextResponse("Cache not flushed: requests pending\n", status_code=400)
        return PlainTextResponse("Cache flushed.\n")

    @app.get("/health")
    async def health():
        return Response(status_code=state["health"])

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        status, payload = SHAPES[body["rid"]]
        if isinstance(payload, str):
            return PlainTextResponse(payload, status_code=status)
        return JSONResponse(payload, status_code=status)

    return app, state

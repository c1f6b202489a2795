"""Build the app from a pipeline (the engine exactly as ``ddtree-rtc run`` builds it) and run uvicorn."""

from __future__ import annotations

from ..model.tokenizer import TokenizerError
from ..pipeline.runner import build_engine
from ..pipeline.schema import PipelineError
from .app import create_app
from .text import Text


def app_from_pipeline(pipe, max_queue: int = 256):
    if pipe.runtime.tensor_parallel != 1:
        # every rank must see the same requests in the same order; the server does not send them yet
        raise PipelineError(f"{pipe.source}: serve runs one rank (runtime.tensor_parallel 1); multi-rank "
                            f"serving is not in this build (ddtree-rtc run --nproc N runs multi-rank pipelines)")
    engine, info = build_engine(pipe, max_batch=pipe.runtime.max_batch)
    name = pipe.model.preset or str(info["dir"].name)
    try:
        text = Text(info["dir"], preset=pipe.model.preset is not None)
    except TokenizerError as e:
        raise PipelineError(f"{pipe.source}: {e}") from None
    return create_app(engine, text, name, pipe.decode, max_queue=max_queue)


def serve(pipe, host: str, port: int, max_queue: int = 256) -> None:
    import uvicorn

    uvicorn.run(app_from_pipeline(pipe, max_queue), host=host, port=port, log_level="info")

"""`cupool serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one `cupool.Engine`.

- `cupool.serve.loader.load(model_dir, device, ...)`: the model, pool and tokenizer of a directory.
- `cupool.serve.app.create_app(engine, tokenizer, model_name)`: the FastAPI app.
- `cupool.serve.cli`: `add_arguments(parser)` and `run(args)` of the `serve` subcommand.
- `cupool.serve.protocol`: the request models, their checks, the response objects.

Needs the `serve` extra (`pip install 'cupool[serve]'`); importing this package and `cli` does
not import FastAPI or uvicorn, so the rest of cupool's command line works without them.
"""

__all__ = ["app", "cli", "loader", "protocol"]

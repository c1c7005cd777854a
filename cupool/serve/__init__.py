"""`cupool serve`: an HTTP server (FastAPI + uvicorn) over one `cupool.Engine`, speaking OpenAI's
API and Anthropic's Messages API.

- `cupool.serve.loader.load(model_dir, device, ...)`: the model, pool and tokenizer of a directory.
- `cupool.serve.app.create_app(engine, tokenizer, model_name, api_key=, max_queue=)`: the app.
- `cupool.serve.cli`: `add_arguments(parser)` and `run(args)` of the `serve` subcommand.
- `cupool.serve.protocol`: OpenAI's request models, their checks, the response objects.
- `cupool.serve.messages`: Anthropic's Messages API (requests, conversion, blocks, events).
- `cupool.serve.chat`: chat requests rendered by the template, outputs parsed back.
- `cupool.serve.formats`: one output parser per chat format (tool calls, reasoning).
- `cupool.serve.generation`: the server's state, a generation's engine requests and events.
- `cupool.serve.grammar`: structured output (llguidance token masks).
- `cupool.serve.auth`, `cupool.serve.metrics`: API keys, Prometheus metrics.

Needs the `serve` extra (`pip install 'cupool[serve]'`); importing this package and `cli` does
not import FastAPI or uvicorn, so the rest of cupool's command line works without them.
"""

__all__ = ["app", "auth", "chat", "cli", "formats", "generation", "grammar", "loader",
           "messages", "metrics", "protocol"]

"""The OpenAI-compatible server (`python -m pipeline.serve`, docs/serve.md): the wire format
(openai_api), what a request becomes in the engine (admit), the thread that runs the engine (loop)
and the HTTP app on uvicorn (app)."""

"""An OpenAI-compatible HTTP server in front of the Triton models: ``python -m frontend.openai``.

    python -m frontend.openai --triton-grpc 127.0.0.1:8001 --port 9000 --model-dir models/smollm2-135m-instruct

A client of Triton's gRPC frontend, so the four models stay exactly as they are: the request's ``model`` names the
Triton model, and so picks the batcher. One module per responsibility:

- ``protocol.py``: the request models (pydantic), what the engine cannot honour, the mapping onto the models' inputs,
  and the OpenAI error body;
- ``chat_template.py``: ``messages`` rendered with the model folder's own chat template;
- ``tools.py``: chat's tools: the grammar each ``tool_choice`` holds the answer to, and the answer parsed into calls;
- ``triton_bridge.py``: one request on its own async gRPC stream, and Triton's answers mapped to OpenAI's statuses;
- ``serving.py``: the OpenAI responses and server-sent events for completions and chat;
- ``app.py``: the FastAPI app and its routes; ``__main__.py``: the command line (uvicorn).
"""

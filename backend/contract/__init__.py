"""What the layers share, below all of them: facts that the models, the frontend, the client and the load tests read
alike, each with one owner here. ``names`` (the shipped models and the metrics they publish), ``prometheus`` (the one
parser of the metrics port), ``errors`` (every error a request can get, its code in the message and what it means
to an HTTP client), ``priority`` (what a request's priority level means), ``settings`` (the default model folder, the
environment variables the processes read), ``server_args`` (tritonserver's command line, and the models' drain
grace that follows from its exit timeout) and ``sampling_ranges`` (what each sampling setting may be, for the engine
and the OpenAI frontend alike).

NOTE: standard library only, and nothing else of the project imported (``tests/unit/test_layering.py``): the models'
Python stub, the probes run as files in a container, and the locust image (which copies this package alone of the
server's code) import it.
"""

"""How the server runs, from outside tritonserver: the launcher's command line (``serve``, what ``make serve`` and the
container run) over ``server`` (one tritonserver process), ``server_home`` (where the binary comes from) and
``launch_options`` (paths, ports, admin flags), with ``config_text`` (config.pbtxt read and written as Triton's
ModelConfig, for copies with other settings); the graceful stop (``shutdown``), the stalled-model watchdog
(``watchdog``), the container probes (``probe``) and ``processes`` (/proc).

NOTE: ``probe.py`` and ``shutdown.py`` also run as files in the container, on the standard library alone, so this
package imports nothing when it loads.
"""

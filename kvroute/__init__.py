"""kvroute: a KV-cache-aware, learning-based load balancer for LLM serving.

The distribution's command line lives here; the parts are the top-level packages
``router_service`` (router), ``models`` (residual models), ``engine_ext`` (worker side) and
``sim`` (simulator, workloads).
"""

__version__ = "0.1.0"

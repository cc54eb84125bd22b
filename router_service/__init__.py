"""kvroute's router: the pure routing core (``router_service.routing``) and its service shell."""

"""Worker side of kvroute: the reference radix cache and (``engine`` extra) the SGLang plugin."""

"""What the user sees of a job in Keras: the callbacks (broadcast, metric and variable
averaging, residual sharing), the per-epoch communication log and the counters behind
``communication_stats()`` and ``layer_stats()``."""

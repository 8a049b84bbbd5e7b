"""From block hashes to a hit length: the key grammar (``keys``), rank namespaces (``layout``),
group specs (``specs``), request hashes (``hashes``), the hybrid coordinator (``coordinator``),
the vLLM release reproduced (``contract``), the deployment and its per-lookup plan
(``deployment``), the key cache (``keycache``), asking in rounds (``rounds``) and the engine that
runs a lookup (``engine``), with its compiled core and pure-Python twin (``_core``)."""

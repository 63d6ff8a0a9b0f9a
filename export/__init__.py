"""Compiles trained artefacts into signed bundles for the SDK (ARCHITECTURE.md §5) and publishes
federated rounds' routers.

- :mod:`export.pipeline`: ``fedroute export``: a trained router folder (``router.json`` with
  ``kmeans.npz`` or the MLP's weights, as ``fedroute simulate`` saves them) -> ONNX embedder (and
  int8) + router file -> a staged bundle loaded through the SDK -> parity gate -> signed bundle.
- :mod:`export.kinds`: the export step of each artefact kind (files, manifest fields, parity gate;
  docs/plugins.md); :mod:`export.router_export` writes ``kmeans.npz`` and ``router.onnx``.
- :mod:`export.publish`: a new signed version of a bundle with a federated round's router, handed to
  the aggregation server by the console-script module (the server never imports ``export``).
- :mod:`export.bundle_writer`, :mod:`export.signing`, :mod:`export.embedder_onnx`,
  :mod:`export.parity`, :mod:`export.errors`.
"""

"""The examples a newcomer runs first answer a wrong path with one line and exit status 2, not a traceback."""

from __future__ import annotations

import runpy

from conftest import ROOT


def test_route_with_trained_router_names_the_missing_router(tmp_path, capsys):
    module = runpy.run_path(str(ROOT / "examples" / "route_with_trained_router.py"))
    assert module["main"](tmp_path / "routers" / "kmeans") == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"error: {tmp_path / 'routers' / 'kmeans' / 'router.json'}: not a saved fedroute router "
        f"([Errno 2] No such file or directory: '{tmp_path / 'routers' / 'kmeans' / 'router.json'}')",
        "(train a router first: the main job writes results/routers/kmeans and .../mlp)",
    ]

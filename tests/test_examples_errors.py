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


def test_a_trained_router_folder_given_to_router_load_says_to_export_it(tmp_path):
    """The newcomer's slip: `Router.load("results/routers/kmeans", ...)` instead of the exported bundle."""
    import pytest
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from sdk import Router
    from sdk.errors import BundleError

    folder = tmp_path / "routers" / "kmeans"
    folder.mkdir(parents=True)
    (folder / "router.json").write_text("{}")
    with pytest.raises(BundleError) as info:
        Router.load(folder, public_key=Ed25519PrivateKey.generate().public_key())
    assert str(info.value) == (f"{folder} is a trained router folder, not a bundle (no manifest.json): make a bundle "
                               f"of it with `fedroute export --router {folder} --out BUNDLE --signing-key KEY`")

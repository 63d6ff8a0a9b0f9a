"""A bundle for latency measurements only: ``fedroute export``'s steps, with the parity report
written but not enforced.

``benchmarks/choose_latency.py`` compares every encoder recipe (fp32, int8, int8-all) in one bundle.
``fedroute export`` writes nothing when one precision misses its gate, and the int8 recipe's cosine
gate depends on the CPU's int8 kernels (on an AVX2 machine without VNNI it measured 0.99377 mean
against the 0.995 gate, while its decisions agreed on 99.67%). This script runs the same export,
quantisation, assembly and parity check (:mod:`export.pipeline`, :mod:`export.parity`), stores the
report as ``parity.json`` with its ``passed`` flag as measured, and signs the bundle anyway. Never
ship such a bundle; use ``fedroute export``.

``--router``: a router trained on the ONNX (sentence-transformer) embedder, e.g. the MiniLM 32-token one
(the README's ``results/device`` is on the static embedder, whose bundle has no encoder recipes)::

    HF_HUB_OFFLINE=1 fedroute simulate --data ../shared/data/routerbench --out results/minilm32 --max-tokens 32
    python benchmarks/latency_bundle.py --router results/minilm32/routers/kmeans --out bundles/latency \
        --signing-key keys/signing.key --data ../shared/data/routerbench
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--router", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--signing-key", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="RouterBench folder for the parity report")
    parser.add_argument("--precisions", default="int8,int8-all", help="quantised encoders besides fp32")
    parser.add_argument("--no-fuse", action="store_true",
                        help="skip the graph fusion of the onnx embedder kind's recipe (export.embedder_fusion), "
                             "for a same-run comparison with the fused bundle")
    args = parser.parse_args(argv)

    from export import kinds as export_kinds
    from export.bundle_writer import PARITY_FILE, next_bundle_version, write_bundle
    from export.embedder_export import EMBEDDER_FAMILY
    from export.embedder_onnx import export_embedder, quantize_precision
    from export.pipeline import _load_test_table, assemble
    from export.signing import load_signing_key
    from sdk import bundle_manifest as fmt
    from sdk.kinds import DEFAULT_EMBEDDER_KIND
    from trainer.embedder_kind import kind_of
    from trainer.embeddings import EmbedderConfig, embed_texts, resolve_model_path
    from trainer.kinds import load_router

    key = load_signing_key(args.signing_key)
    router = load_router(args.router)
    emb = router.embedder
    kind = emb.get("kind") or kind_of(emb["name"])[0].name  # router.json names a non-default kind (static); else the name
    if kind != DEFAULT_EMBEDDER_KIND:
        parser.error(f"--router {args.router} was trained on the {kind!r} embedder ({emb['name']}), which has no ONNX "
                     "encoder recipes to export; give a sentence-transformer router, e.g. results/minilm32/routers/kmeans "
                     "of `fedroute simulate --max-tokens 32 --out results/minilm32`")
    config = EmbedderConfig(model=emb["name"], max_tokens=int(emb["max_tokens"]), truncation_side=emb["truncation_side"])
    test = _load_test_table(router, args.data).with_models(router.models)
    with tempfile.TemporaryDirectory(prefix="fedroute-latency-") as tmp:
        tmp = Path(tmp)
        fuse = export_kinds.get("onnx", EMBEDDER_FAMILY).fuse_graph and not args.no_fuse
        exported = export_embedder(resolve_model_path(config.model), tmp / "embedder", config.max_tokens,
                                   config.truncation_side, fuse=fuse)
        print(f"encoder graph {'fused: ' + str(exported.fused_ops) if exported.fused_ops else 'not fused'}")
        quantised = {p: quantize_precision(exported.model, tmp / fmt.EMBEDDER_FILES[p], p)
                     for p in args.precisions.split(",") if p}
        files, fields = assemble(router, exported, quantised, config.model, config.max_tokens, config.truncation_side,
                                 {}, 1)
        staged = tmp / "staged"
        write_bundle(staged, files, fields, key)
        reference = embed_texts(list(test.prompts), config, show_progress=False)
        report = export_kinds.get(router.kind).parity(staged, key.public_key(), router, reference, test,
                                                      list(fields["embedder"]["files"]))
    files[PARITY_FILE] = (json.dumps(report, indent=2, sort_keys=True) + "\n").encode()
    fields["bundle_version"] = next_bundle_version(args.out)
    write_bundle(args.out, files, fields, key)
    print(f"wrote {args.out} (parity {'passed' if report['passed'] else 'NOT passed: ' + '; '.join(report['failures'])})")
    return report


if __name__ == "__main__":
    main()

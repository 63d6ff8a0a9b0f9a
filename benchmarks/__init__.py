"""Benchmarks of fedroute (speed, load, settings chosen on validation). A regular package, so that
no installed top-level ``benchmarks`` (the opacus wheel ships one) shadows it."""

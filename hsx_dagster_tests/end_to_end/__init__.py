"""End-to-end tests: the pipeline as users run it, with real components: crash and damage (reliability), the
webserver and Chromium, PostgreSQL, a Ray cluster, the trainers' own code, the benchmarks' commands."""

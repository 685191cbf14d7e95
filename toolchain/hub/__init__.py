"""Qualcomm AI Hub behind a small client interface: the real client (needs a token), the job
plans (compile, link, profile, calibrate) and a recording fake for tests and --dry-run."""

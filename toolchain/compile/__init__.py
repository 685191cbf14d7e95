"""The compile pipeline, one stage per module: recipe -> source -> capture -> export ->
pass_runner -> emit -> verify (and reverify for `mobc verify`); pipeline.py drives them, report.py
renders what they recorded."""

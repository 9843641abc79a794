"""Nightly: build -> train -> gate -> publish -> report, once a night (`nightshift nightly`).

run (a resumable state machine under a lock: each stage's result saved before the
next starts, so a killed run resumes where it stopped and publishes at most once)
-> report (a Markdown page and a plot per night).
"""

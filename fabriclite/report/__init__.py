"""A job's history as a picture: ``fabriclite report RUN_FOLDER_OR_EVENTS`` reads the events record
(job_history.py) and writes one self-contained HTML page (html_page.py, page_style.py) or Chrome trace-event JSON
for Perfetto (perfetto_trace.py). Nothing here runs during a job; nothing is imported by ``import fabriclite``."""

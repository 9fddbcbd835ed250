"""The router's live pool page: ``/ui`` (HTML, vanilla JS, CSS served from ``static/``) and ``/ui/state``."""

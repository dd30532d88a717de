"""Operations: Prometheus metrics (``metrics``), the HTTP endpoint (``web``), the status report (``status``) and the
controller's status page (``status_page``, with its ``static/`` files)."""

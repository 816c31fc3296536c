# Stand-in for python:3.11-slim, from Debian bookworm's packages: `python` and `pip` on PATH, the
# headers (vLLM's CPU engine compiles kernels at start) and pip allowed to install system-wide.
FROM dockrl-debian:bookworm
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-dev python3-pip python3-venv python-is-python3 ca-certificates \
    && rm -f /usr/lib/python3*/EXTERNALLY-MANAGED \
    && ln -sf /usr/bin/pip3 /usr/local/bin/pip \
    && rm -rf /var/lib/apt/lists/*
ENV LANG=C.UTF-8
CMD ["python3"]

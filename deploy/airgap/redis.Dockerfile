# Stand-in for redis:7, from Debian bookworm's redis-server (7.0): `redis-server` and `redis-cli`
# on PATH, data in /data as in the official image.
FROM dockrl-debian:bookworm
RUN apt-get update && apt-get install -y --no-install-recommends redis-server redis-tools \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /data
WORKDIR /data
EXPOSE 6379
CMD ["redis-server"]

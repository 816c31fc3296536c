# Stand-in for nginx:1.27, from Debian bookworm's nginx (1.22): the same /etc/nginx/conf.d include
# and `daemon off` in the foreground as the official image; Debian's default site removed.
FROM dockrl-debian:bookworm
RUN apt-get update && apt-get install -y --no-install-recommends nginx-light \
    && rm -rf /var/lib/apt/lists/* /etc/nginx/sites-enabled/default \
    && ln -sf /dev/stdout /var/log/nginx/access.log && ln -sf /dev/stderr /var/log/nginx/error.log
EXPOSE 80
STOPSIGNAL SIGQUIT
CMD ["nginx", "-g", "daemon off;"]

"""Running spilld under a service manager (launchd on macOS, systemd on Linux).

- ``sdnotify``: systemd's notify protocol (READY, STOPPING, WATCHDOG, EXTEND_TIMEOUT_USEC, STATUS);
- ``activation``: the listening socket a manager passes (systemd's LISTEN_FDS, launchd's launch_activate_socket);
- ``lifecycle``: what the daemon tells its manager as it starts, runs and drains;
- ``units``: the plist and unit files, rendered for one installation;
- ``install``: ``spilld service install|uninstall|status``.
"""

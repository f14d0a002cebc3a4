# The API key xAgent presents to this device, generated once on first install into
# /etc/imgate/api_key (root:imgate, 0640), which the packaged imgate.conf names as api_key_file.
# An existing key is never replaced. Returns 0 only when it wrote a new key.
imgate_api_key() {
	[ -e /etc/imgate/api_key ] && return 1
	(
		umask 077
		# 32 random bytes as 64 hex digits: od and tr are in busybox as in coreutils.
		key=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
		[ ${#key} -eq 64 ] || exit 1
		printf '%s\n' "$key" > /etc/imgate/api_key.new
	) || return 1
	chown root:imgate /etc/imgate/api_key.new
	chmod 0640 /etc/imgate/api_key.new
	mv /etc/imgate/api_key.new /etc/imgate/api_key
}

# What the owner pastes into xAgent. The key itself is never printed: installers keep logs.
imgate_api_key_message() {
	host=$(cat /proc/sys/kernel/hostname 2>/dev/null || echo DEVICE)
	cat <<MSG

imgate: an API key for xAgent was generated in /etc/imgate/api_key.
In xAgent, add a Connector with
  base URL:  http://$host:8787
  API key:   the contents of /etc/imgate/api_key (as root: cat /etc/imgate/api_key)
Configure endpoints and providers in /etc/imgate/imgate.conf, then restart imgate.

MSG
}

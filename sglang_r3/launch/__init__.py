"""Start-up: the checks every process runs before serving (hooks applied, options
safe) and the fleet's router settings the launcher and the deployment share."""

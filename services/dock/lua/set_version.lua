-- set_version: ARGV caller (lib.lua), version. Records the policy version the trainer collects samples for;
-- refused when the dock is gone, so a lost dock is never half re-created by this one field.
local meta, err = open(ARGV[1])
if not meta then return err end
redis.call('HSET', k('meta'), 'policy_version', ARGV[2])
return 1

-- Delete a rollout and its views (each view is its own hash in the rollout's slot).
-- KEYS[1]  rollout hash
-- Returns  the number of rollout keys deleted (0: there was none)
local key = KEYS[1]
for _, f in ipairs(redis.call('HKEYS', key)) do
  local serves = string.match(f, '^v:(%d+)$')
  if serves then redis.call('DEL', key .. ':v:' .. serves) end
end
return redis.call('DEL', key)

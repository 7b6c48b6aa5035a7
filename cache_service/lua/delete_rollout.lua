-- Delete a rollout and its views (each view is its own hash in the rollout's slot).
-- KEYS[1]  rollout hash
-- Returns  {deleted, memory}: deleted = the rollout keys deleted (0: there was none);
--          memory = MEMORY USAGE (every field) of the rollout hash and its views' hashes
--          before the delete, what Redis frees (shared blobs excepted: they expire);
--          -1 when the operator disabled MEMORY
local key = KEYS[1]
local function usage(k)
  local m = redis.pcall('MEMORY', 'USAGE', k, 'SAMPLES', '0')
  if type(m) == 'number' then return m end
  if type(m) == 'table' and m.err then return -1 end
  return 0
end
local mem = usage(key)
for _, f in ipairs(redis.call('HKEYS', key)) do
  local serves = string.match(f, '^v:(%d+)$')
  if serves then
    local vkey = key .. ':v:' .. serves
    if mem >= 0 then
      local m = usage(vkey)
      if m < 0 then mem = -1 else mem = mem + m end
    end
    redis.call('DEL', vkey)
  end
end
return {redis.call('DEL', key), mem}

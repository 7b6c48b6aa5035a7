-- Release one reference to a shared blob; delete the blob when none is left.
-- KEYS[1]  blob hash
-- ARGV     reference token (put_blob.lua)
-- Called only after the referencing rollout's field is gone (deleted, dropped, rewound)
-- or was never written (the put was refused), so no rollout points at a blob this
-- deletes.  A blob written before references were kept has no rc: it is left to its TTL.
-- Returns  {released, memory}: released = 1 when the token held a reference; memory =
--          MEMORY USAGE of the blob when this call deleted it (else 0; -1 when the
--          operator disabled MEMORY)
local key = KEYS[1]
if redis.call('HDEL', key, 'x:' .. ARGV[1]) == 0 then return {0, 0} end
local left = redis.call('HINCRBY', key, 'rc', -1)
if left > 0 then return {1, 0} end
local m = redis.pcall('MEMORY', 'USAGE', key, 'SAMPLES', '0')
local mem = 0
if type(m) == 'number' then mem = m elseif type(m) == 'table' and m.err then mem = -1 end
redis.call('DEL', key)
return {1, mem}

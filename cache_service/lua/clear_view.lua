-- Drop a view that serves no stored segment yet (a call whose view was stored but whose
-- own segment was not: its retry recomputes the view, maybe with other rows).
-- KEYS[1]  rollout hash, KEYS[2] the view's hash
-- ARGV     serves
-- Returns  {"served"} when a stored segment starts at serves (the view is then fixed),
--          else {"cleared"}
local key, vkey, serves = KEYS[1], KEYS[2], ARGV[1]
for _, f in ipairs(redis.call('HKEYS', key)) do
  if string.match(f, '^d:(%d+):') == serves then return {'served'} end
end
redis.call('DEL', vkey)
redis.call('HDEL', key, 'v:' .. serves)
return {'cleared'}

"""A fixed vocabulary of common English words for generated prompts.

Every word here is exactly one token for the SmolLM2 tokenizer both at the start of a text and
after a space (checked when the list was made), so N words joined by spaces are N tokens for
that model; other BPE tokenizers of the same kind stay close to one token per word. Real
words, unlike random token ids, give text a tokenizer and a chat template handle normally.
"""

from __future__ import annotations

WORDS: tuple[str, ...] = tuple(
    """
able about above act add after again age ago agree air all allow almost alone along already
also always among amount and animal answer any apple area arm around art ask atom away baby
back bad ball bank base bear beat bed before begin bell best better between big bird black
block blood blow blue board boat body bone book born both bottom box boy branch bread break
bright brother brown build burn buy call camp can capital car card care case cat catch cause
cell center century chair change charge chart check chief child choose church circle city
claim class clean clear clock close cloth cloud coast coat cold collect color column come
common company compare complete condition connect consider continue control cook cool copy
corn correct cost count country course cover create crop cross current cut dark day dead deal
death deep degree depend describe design detail develop direct divide doctor dog dollar door
double down draw dream drive drop dry during each early earth east eat edge effect egg eight
either electric element else end energy engine enough enter equal even event ever every exact
example except exercise expect experience experiment eye face fact fair fall family famous far
farm fast father feed feel few field fight figure fill final find fine finger finish fire
first fish fit five flat floor flow flower fly follow food foot force forest form forward
found four free fresh friend front fruit full game gas gather get girl give glass gold good
govern grand grass great green ground group grow guess guide hair half hand happy hard hat
have head heart heat heavy help here high hill history hold hole home horse hot hour house
human hundred idea inch include industry interest invent iron job join joy jump keep key kind
king know lake land language large last late law lay lead learn least leave left leg length
less letter level lie life lift light line liquid list listen little live long look lost love
low machine main major make man many map mark market mass master match material matter meat
member metal method middle might mile milk million mind mine minute miss modern moment money
month moon mother motion mouth move music name nation nature near neck need never new next
night nine noise north nose note nothing noun number object ocean offer office often oil old
once one open order organ original other ought oxygen page pair paper paragraph parent part
party pass past path pattern pay people perhaps period person phrase picture piece place plain
plan plane planet plant play please plural point pole poor popular port position possible
pound power practice prepare present press pretty print problem process product property pull
push put quart question quick quiet quite race radio rain raise range rather reach read ready
real reason receive record region remember repeat reply represent require rest result rich
ride right ring rise river road rock roll room root rose round row rule run safe salt same
sand save say scale school science score sea search season seat second section see seed select
self sell send sense sentence seven several shape share sharp sheet shell shine ship shop
shore short show side sight sign similar simple since sing single sit six size skill skin sky
sleep slow small snow soft soil solution solve some son song soon sound south space special
speech speed spread spring square stand star start state station stay step stick still stone
stood stop store story stream street string strong student study subject success sugar summer
sun supply support surface system table tail take talk tall team tell temperature ten term
test than thank thick thin thing think third three through tie time tiny together tone tool
top total touch town track trade train travel tree trip true try tube turn two type under unit
until use usual value vary verb very view visit voice wait walk wall want war warm wash watch
water wave way wear weather week weight well west wheel where whether while white whole wide
wife wild will win wind window wing winter wire woman wood word work world write yard year
yellow young
""".split()
)

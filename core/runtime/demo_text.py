"""A few pages of plain English, written for this project, that demo checkpoints train their tokenizer on.

The text only has to make ordinary English encode sensibly (common words and endings become single tokens); it is
small on purpose so that training takes milliseconds.
"""

DEMO_TEXT = """\
The Keeper of the Hive

Every morning, before the sun is high, the old keeper walks along the row of hives at the edge of the orchard. She
does not open them yet. She stands beside each one and listens. A strong colony sounds like a low, steady hum; a
colony that has lost its queen sounds thin and restless, and an experienced keeper can hear the difference from a
few steps away. When she has listened to all of them, she writes a short note in a small book: the date, the
weather, which hives were loud and which were quiet.

The bees have been busy for hours already. The first foragers leave as soon as the air is warm enough to fly, and
they return heavy with nectar from the apple trees, the clover in the meadow and the lime trees along the road.
Each worker visits hundreds of flowers on a good day. She remembers where the best flowers are, and when she comes
home she dances on the comb to tell her sisters the direction and the distance. The angle of the dance points the
way relative to the sun, and the length of the waggle tells how far to fly.

Inside the hive, the work is shared. The youngest bees clean the cells and feed the larvae. Older bees build new
comb, store the nectar and fan their wings to dry it into honey. The oldest bees guard the entrance and go out to
forage. Nobody gives orders, and yet the whole colony behaves as if it had a plan. Each bee follows a few simple
rules, reacts to what the others are doing, and together they make decisions that no single bee could make alone.

Questions and answers

What does a beekeeper need to start? A hive, a veil, a smoker, a hive tool and a little patience. Most people
begin with two colonies, so that they can compare them and borrow brood from one if the other gets weak.

How much honey does one hive make? It depends on the weather, the flowers nearby and the strength of the colony.
In a good year a strong hive can give twenty or thirty kilograms, and in a wet summer it may give nothing at all.

Why do bees swarm? When a colony grows too large for its home, the old queen leaves with about half of the workers
to look for a new place to live. The bees that stay behind raise a new queen. A swarm hanging from a branch looks
frightening, but it is usually calm, because the bees are full of honey and have no home to defend.

Is it hard to learn? Not really. It takes a season or two to feel comfortable, and many years to become good at it.
The best teachers are the bees themselves and a neighbour who has kept them for a long time.

The swarm of computers

People who run large language models at home face a problem that the bees would understand. A modern model is
too large for one small machine: its weights do not fit in the memory of a single graphics card, and sometimes not
even in the main memory of the computer. There are two ways around this. The first is to move parts of the model
between the fast memory and the slow memory while it runs, loading each layer just before it is needed and putting
it back afterwards. This is called offloading, and with a careful plan it can be surprisingly fast, because the next
layer can be copied while the current one is computing.

The second way is to share the work. Many volunteers each keep a few layers of the model in memory and serve them
to everyone else over the network. A client that wants to generate text sends its hidden states from one server to
the next, layer by layer, and gets the result back. No single machine holds the whole model, and yet together they
can run it, much like the workers of a hive who each do a small part of a large job.

Planning matters in both cases. How many layers should a server hold? How much memory should be kept for the
attention cache? Is the network or the disk the bottleneck? A good planner measures the machine, estimates the cost
of each choice, and explains its answer in plain words: this plan will generate about five tokens per second, it
will use twelve gigabytes of memory, and it is limited by the speed of the disk.

A short conversation

User: Hello! Can you tell me what the weather will be like tomorrow?
Assistant: I am sorry, but I cannot see a weather forecast from here. You could check a local weather service, or
look at the sky this evening: a clear red sunset often means a dry morning.
User: Thank you. What should I cook for dinner tonight?
Assistant: A simple soup is a good choice on a cold day. Cut an onion, two carrots and a few potatoes, cook them
slowly in a little butter, add water or stock, and let everything simmer for twenty minutes. Season it with salt,
pepper and fresh herbs, and serve it with warm bread.
User: That sounds lovely. One more question: how do I say thank you in French?
Assistant: You say "merci", and if you want to be very polite, "merci beaucoup".

Numbers, lists and code

The first ten numbers are 1, 2, 3, 4, 5, 6, 7, 8, 9 and 10. A year has 365 days, or 366 in a leap year. The
temperature today is 21 degrees, which is 70 degrees Fahrenheit. Version 2.0 was released on 12 March 2024.

Things to bring on a walk: water, a map, a warm jacket, some food, and a phone with a full battery.

    def add(a, b):
        # return the sum of two numbers
        return a + b

    for i in range(10):
        print(i, add(i, i))

A note on language

Words are made of smaller pieces. A tokenizer splits text into such pieces, called tokens, and gives each one a
number. Common words like "the", "and" or "house" become a single token, while rare words are split into several
parts, such as "un", "believ" and "able". The model never sees letters, only these numbers, and it learns which
numbers tend to follow which. When it writes, it chooses one token at a time, and the tokenizer turns the numbers
back into text. Sampling decides how adventurous that choice is: always taking the most likely token gives safe and
often repetitive text, while a higher temperature gives more surprising answers.

Evening

In the evening the keeper returns to the orchard. The hives are quiet now, and the last foragers are coming home
as the light fades. She opens one hive to check the frames, moving slowly so that the bees stay calm. There is fresh
honey at the top of the comb, white wax over the full cells, and eggs in the centre where the queen has been laying.
Everything is as it should be. She closes the lid, writes one more line in her book, and walks back to the house
while the first stars appear above the trees.
"""
